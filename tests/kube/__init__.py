"""Tests of gitops_sless.kube."""
