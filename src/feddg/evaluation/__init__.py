"""Accuracy per domain, result tables and plots."""
