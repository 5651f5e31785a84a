"""A strict test double of the Kubernetes API server, for the official ``kubernetes`` client.

``FakeKube`` serves the REST API (core/v1 namespaces, secrets, configmaps, serviceaccounts,
services with ``/proxy``, pods with ``/log`` and ``/proxy``; apps/v1 deployments with
``/scale``; batch/v1 jobs and cronjobs; networking.k8s.io/v1 networkpolicies;
coordination.k8s.io/v1 leases; apiextensions.k8s.io/v1 customresourcedefinitions and, once a
CRD is established, its custom resources with their ``/status`` subresource; discovery and
``/version``) over HTTP (or HTTPS, ``tls=True``) on 127.0.0.1 with bearer-token auth, and runs
controllers and a kubelet so Deployments become available, Jobs run and kaniko builds read
their context from S3. Modules: ``server`` (HTTP), ``routes`` (paths, discovery), ``store``
(objects, resourceVersion, selectors), ``resources`` (kinds, the registry of served kinds,
errors), ``apply`` (server-side apply), ``patches`` (bodies, patch formats), ``validate``
(cached strict schemas), ``defaults``, ``ops`` (the verbs), ``status`` (status subresource
writes), ``scale`` (the scale subresource), ``crds`` (CustomResourceDefinitions), ``custom``
(pruning, defaulting, validation of custom resources), ``controllers``, ``cronjobs``,
``kubelet``, ``runtimes`` (real runtime servers for some pods), ``kaniko``, ``tables`` (what
``kubectl get`` prints), ``tls`` (HTTPS with a CA of its own, for ``kubectl``), ``fake``
(``FakeKube``, ``install_crd``), ``fixtures`` (the ``fake_kube`` fixture); ``python -m
tests.kubeapi`` runs it standalone.

Where it differs from a real cluster (the rest is meant to match it):

* Server-side apply is simplified (see ``apply``): lists are atomic except lists of objects
  keyed by ``name``; conflicts on exact leaf paths; managers told apart by name only.
* Deletion is immediate: no graceful termination, no finalizers, a namespace and its
  contents are gone at once (the DELETE answers the namespace with phase Terminating).
  Garbage collection (Background/Foreground alike, or Orphan) happens inside the request.
* Deployments own their pods directly (no ReplicaSets); a rollout creates every new pod at
  once and deletes old pods as new ones become ready; minReadySeconds and paused are not
  honoured; the progress deadline counts from the last spec change.
* Jobs retry failed pods at once (no backoff delay); OnFailure is treated like Never;
  indexed completion and pod failure policies are not modelled. CronJobs never fire by
  themselves: ``fire_cronjob`` does it.
* Controller and kubelet writes record no managedFields (except the Deployment revision
  annotation); ``/status`` writes over HTTP record entries with ``subresource: status``.
* Custom resources: unknown fields are pruned (with a ``Warning``; ``fieldValidation=Strict``
  refuses them) while built-in kinds answer 422 for them (strict schemas); CEL rules
  (``x-kubernetes-validations``), ``format`` and list types/map keys are not checked, and
  server-side apply merges their lists like any other (by ``name`` only); printer columns are
  rendered for ``kubectl get`` with simple ``.a.b`` paths only (see ``tables``); no scale
  subresource. CRDs: see ``crds`` (objects
  stored by kind, so a kind already served is not accepted; conversion is always None).
* ``limit``/``continue`` are ignored (lists are whole); a watch filters events by selector
  but does not turn an object that stops matching into a DELETED event.
* Pods never really run: images "pull" when built here or preloaded, secrets and config maps
  are checked, a Job pod ends after ``job_seconds`` with the log set for its Job. Except the
  pods of a Deployment given to ``run_runtime``: each runs a real runtime server (``runtimes``),
  which the pod proxy reaches.
"""

from .fake import FakeKube

__all__ = ["FakeKube"]
