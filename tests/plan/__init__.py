"""Tests of gitops_sless.plan."""
