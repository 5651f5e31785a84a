"""Tests of gitops_sless.steps: each step of a pass, run alone."""
