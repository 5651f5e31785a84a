"""Tests of gitops_sless.web."""
