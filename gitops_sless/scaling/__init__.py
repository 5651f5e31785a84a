"""Scaling: how many replicas each autoscaled function runs, decided tick by tick.

``autoscaler`` decides for one function from its load (Knative's KPA: a stable and
a panic window), ``warm`` works out the floors a schedule raises, and ``scaler``
runs the tick for every autoscaled route and writes decisions through the
backend. Holding a call while a replica starts is the proxy's (``proxy.activator``).

May import: state, plan, manifests and the layers below.
"""
