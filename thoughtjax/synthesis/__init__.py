"""Synthesis: from a request's hints and latency budget to the best calibrated path."""
