"""Tests of gitops_sless.source."""
