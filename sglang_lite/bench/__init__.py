"""Benchmark helpers: DP-rank balance sampling, request traces and their replay."""
