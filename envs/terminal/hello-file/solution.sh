#!/bin/bash
echo "hello world" > /app/hello.txt
