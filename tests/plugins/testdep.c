/* A dependency library of the missing_dep test plugin; the test suite moves it off every path. */
int attnrt_testdep_value(void) { return 42; }
