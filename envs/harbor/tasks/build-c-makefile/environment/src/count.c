#include <ctype.h>
#include "count.h"

long count_words(FILE *f) {
    long n = 0;
    int c, in = 0;
    while ((c = fgetc(f)) != EOF) {
        if (isspace(c)) in = 0;
        else if (!in) { in = 1; n++; }
    }
    return n;
}
