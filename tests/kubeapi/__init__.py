"""A strict test double of the Kubernetes API server, for the official ``kubernetes`` client.

``FakeKube`` serves the REST API (core/v1 namespaces, secrets, configmaps, serviceaccounts,
services with ``/proxy``, pods with ``/log``; apps/v1 deployments; batch/v1 jobs and cronjobs;
networking.k8s.io/v1 networkpolicies; coordination.k8s.io/v1 leases) over HTTP on 127.0.0.1
with bearer-token auth, and runs controllers and a kubelet so Deployments become available,
Jobs run and kaniko builds read their context from S3. Modules: ``server`` (HTTP),
``store`` (objects, resourceVersion, selectors), ``apply`` (server-side apply, patches),
``validate`` (cached strict schemas), ``defaults``, ``ops`` (the verbs), ``controllers`` and
``kubelet``, ``fake`` (the ``FakeKube`` object), ``fixtures`` (the ``fake_kube`` fixture)."""

from .fake import FakeKube

__all__ = ["FakeKube"]
