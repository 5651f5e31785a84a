"""Tests of gitops_sless.cli."""
