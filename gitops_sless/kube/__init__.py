"""The Kubernetes backend."""
