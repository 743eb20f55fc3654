#include <stdio.h>
long count_words(FILE *f);
