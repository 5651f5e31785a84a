"""Tests of gitops_sless.previews."""
