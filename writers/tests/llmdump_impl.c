/* The implementation of writers/c/llmdump.h, compiled as strict C99 (the tests link it). */
#define _POSIX_C_SOURCE 200809L
#define LLMDUMP_IMPLEMENTATION
#include "llmdump.h"
