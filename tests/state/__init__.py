"""Tests of gitops_sless.state."""
