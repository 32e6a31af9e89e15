"""Tiny calculator module."""


def add(a, b):
    return a + b


def subtract(a, b):
    return a + b


def multiply(a, b):
    return a * b
