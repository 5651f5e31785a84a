"""A function's phase, read off its Deployment and pods the way ``kubectl rollout status`` does.

``Ready``: the Deployment's controller has seen the current generation and
every wanted replica is updated and available (an autoscaled one: it serves
its current template while the autoscaler adds or removes replicas).
``Disabled``: zero replicas because the manifest says so. ``Idle``: an
autoscaled function at zero replicas (a call starts one). ``Failed``: the
rollout passed its progress deadline, or a pod crash-loops (with the
container's last termination reason). ``Pending`` otherwise, with the reason a
pod gives (a missing Secret, an image that cannot be pulled) rather than a
silent wait.
"""

from __future__ import annotations

from typing import Any

from ..plan.backend import Health
from .policy import RoutePolicy
from .renderer import BUILD_LABEL, FUNCTION_LABEL, REVISION
from .view import View, annotation, label

__all__ = [
    "STUCK",
    "available_replicas",
    "health",
    "needs_pods",
    "start_problem",
    "stuck_reason",
]

# waiting reasons that will not fix themselves without a change (kubelet's names)
STUCK = ("CreateContainerConfigError", "ErrImagePull", "ImagePullBackOff", "InvalidImageName")


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def rolled_out(deployment: dict[str, Any]) -> bool:
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    wanted = int(spec.get("replicas", 1))
    current = int(status.get("observedGeneration") or 0) >= int(
        deployment["metadata"].get("generation") or 1
    )
    return current and all(
        int(status.get(field) or 0) >= wanted
        for field in ("updatedReplicas", "availableReplicas", "readyReplicas")
    )


def available_replicas(deployment: dict[str, Any]) -> int:
    """Replicas that serve, as the Deployment's controller counts them (ready for
    minReadySeconds): what a user compares with the replicas the manifest asks for."""
    return int((deployment.get("status") or {}).get("availableReplicas") or 0)


def needs_pods(view: View) -> bool:
    """Pods are read only when a rollout is not done: a settled pass reads none."""
    return any(not rolled_out(d) for d in view.all("Deployment"))


def stuck_reason(pods: list[dict[str, Any]]) -> str | None:
    """``Reason: message`` of the first container that cannot start without a change."""
    for pod in pods:
        found = pod.get("status") or {}
        for status in (found.get("initContainerStatuses") or []) + (
            found.get("containerStatuses") or []
        ):
            waiting = (status.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK:
                return f"{waiting['reason']}: {waiting.get('message') or ''}".strip()
    return None


def _pod_problem(pods: list[dict[str, Any]]) -> tuple[str, str, str | None, int] | None:
    """(phase, message, last exit, restarts): a crash loop first, else a stuck pod."""
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (status.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") != "CrashLoopBackOff":
                continue
            last = (status.get("lastState") or {}).get("terminated") or {}
            last_exit = (
                f"{last.get('reason') or 'Error'}: exit code {last.get('exitCode')}"
                if last
                else None
            )
            restarts = int(status.get("restartCount") or 0)
            return "Failed", f"CrashLoopBackOff: last exit {last_exit}", last_exit, restarts
    reason = stuck_reason(pods)
    return ("Pending", reason, None, 0) if reason else None


def start_problem(pods: list[dict[str, Any]]) -> str | None:
    """Why a function's pods do not start, as its status says it (a crash loop first, else
    a container stuck waiting); None while they may yet."""
    problem = _pod_problem(pods)
    return problem[1] if problem else None


def health(view: View, name: str) -> Health | None:
    """The function ``name`` as its objects show it; None when it has none."""
    objects = view.of_function(name)
    if not objects:
        return None
    primary = view.primary(name)
    revision = annotation(primary, REVISION) if primary else None
    tag = next(filter(None, map(_image_tag, objects)), None)
    deployment = view.get("Deployment", name)
    if deployment is None:  # cron-only: its CronJobs are the function
        crons = view.of_function(name, ("CronJob",))
        suspended = all((c.get("spec") or {}).get("suspend") for c in crons)
        return Health("Disabled" if suspended else "Ready", None, revision=revision, build_tag=tag)
    wanted = int((deployment.get("spec") or {}).get("replicas", 1))
    policy = RoutePolicy.decode(deployment)
    scale = policy.scale if policy is not None else None
    if scale is not None and wanted == 0:
        idle = f"no calls for {scale.idle_sec:g}s: no replica runs; a call starts one"
        return Health("Idle", idle, revision=revision, build_tag=tag)
    if rolled_out(deployment) or (scale is not None and _scaling(deployment)):
        phase = "Ready" if wanted else "Disabled"
        return Health(phase, None, revision=revision, build_tag=tag)
    pods = [p for p in view.pods or [] if label(p, FUNCTION_LABEL) == name]
    problem = _pod_problem(pods)
    progressing = _condition(deployment, "Progressing")
    if progressing.get("reason") == "ProgressDeadlineExceeded":
        message = f"rollout stalled: {progressing.get('message') or 'ProgressDeadlineExceeded'}"
        if problem:
            message += f" ({problem[1]})"
        return Health("Failed", message, problem[2] if problem else None, revision=revision)
    if problem:
        phase, message, last_exit, restarts = problem
        return Health(phase, message, last_exit, restarts, revision, tag, settling=True)
    message = f"rolling out: {available_replicas(deployment)}/{wanted} replicas available"
    return Health("Pending", message, revision=revision, build_tag=tag, settling=True)


def _scaling(deployment: dict[str, Any]) -> bool:
    """An autoscaled Deployment that serves its current template while the autoscaler
    changes how many replicas run: Ready, not a rollout (no old pods, one available)."""
    status = deployment.get("status") or {}
    current = int(status.get("observedGeneration") or 0) >= int(
        deployment["metadata"].get("generation") or 1
    )
    updated = int(status.get("updatedReplicas") or 0) >= int(status.get("replicas") or 0)
    return current and updated and available_replicas(deployment) > 0


def _image_tag(obj: dict[str, Any]) -> str | None:
    """The build tag an object runs: its pods' label (their image names a digest), else the
    image's tag (objects written before images were pinned); a Service has none."""
    spec = obj.get("spec") or {}
    if "jobTemplate" in spec:
        spec = spec["jobTemplate"].get("spec") or {}
    template = spec.get("template") or {}
    tag = ((template.get("metadata") or {}).get("labels") or {}).get(BUILD_LABEL)
    if tag:
        return str(tag)
    containers = (template.get("spec") or {}).get("containers") or [{}]
    image = str(containers[0].get("image") or "").split("@", 1)[0]
    return image.rsplit(":", 1)[-1] if ":" in image.rsplit("/", 1)[-1] else None
