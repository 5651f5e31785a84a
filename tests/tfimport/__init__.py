"""Tests of gitops_sless.tfimport."""
