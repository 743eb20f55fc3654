#!/bin/sh
n=0
for f in $(ls $1 | grep .txt); do
    cp $1/$f $2/$f.bak
    n=$((n + 1))
done
echo $n
