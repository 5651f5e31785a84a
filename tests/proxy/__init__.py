"""Tests of gitops_sless.proxy."""
