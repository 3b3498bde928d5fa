"""Verification: runners share one lifecycle, a comparator runs the same inputs through each."""
