// attnrt: attention runtime for LLM inference. Include this for the whole public C++ API.
#pragma once

#include "attnrt/errors.h"
#include "attnrt/kv_cache.h"
#include "attnrt/log.h"
#include "attnrt/model.h"
#include "attnrt/problem.h"
#include "attnrt/runtime.h"
#include "attnrt/types.h"
