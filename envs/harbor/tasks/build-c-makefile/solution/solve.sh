#!/bin/bash
set -e
cd /app
printf 'CC = gcc\nCFLAGS = -O2 -Wall\n\nbin/wc-lite: src/main.o src/count.o\n\tmkdir -p bin\n\t$(CC) $(CFLAGS) -o $@ $^\n\nsrc/%%.o: src/%%.c src/count.h\n\t$(CC) $(CFLAGS) -c -o $@ $<\n\nclean:\n\trm -rf bin src/*.o\n' > Makefile
make
