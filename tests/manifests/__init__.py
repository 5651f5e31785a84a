"""Tests of gitops_sless.manifests."""
