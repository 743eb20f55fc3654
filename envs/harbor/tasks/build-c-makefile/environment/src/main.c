#include <stdio.h>
#include "count.h"

int main(void) {
    printf("%ld\n", count_words(stdin));
    return 0;
}
