"""Tests of gitops_sless.local."""
