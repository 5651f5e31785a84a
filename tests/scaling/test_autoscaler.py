"""The autoscaler's decisions (Knative's KPA) and warm floors, on a test clock."""

from __future__ import annotations

from datetime import UTC, datetime

from gitops_sless.manifests.model import Scale, Warm
from gitops_sless.scaling import warm
from gitops_sless.scaling.autoscaler import Autoscaler, Windows
from gitops_sless.scaling.scaler import Scaler
from gitops_sless.state.routes import Route, RouteTable

WINDOWS = Windows(stable_sec=60, panic_sec=6, tick_sec=1)
POLICY = Scale(1, 10, target=10, idle_sec=300)


class Load:
    """Concurrency held steady between ticks: busy grows by concurrency x seconds."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0

    def run(self, seconds: float, concurrency: float) -> None:
        self.now += seconds
        self.busy += seconds * concurrency


def _drive(
    scaler: Autoscaler,
    load: Load,
    seconds: int,
    concurrency: float,
    ready: int,
    policy: Scale = POLICY,
    floor: int | None = None,
    idle_for: float = 0.0,
) -> list[int]:
    decided = []
    for _ in range(seconds):
        load.run(1, concurrency)
        decision = scaler.decide(
            policy, policy.min if floor is None else floor, load.now, load.busy, ready, idle_for
        )
        decided.append(decision.desired)
    return decided


def test_steady_load_gets_ceil_of_concurrency_over_target():
    load = Load()
    scaler = Autoscaler(WINDOWS, 0.0, 0.0)
    assert _drive(scaler, load, 70, 35, ready=4)[-1] == 4  # ceil(35 / 10)


def test_a_burst_panics_up_at_once_and_never_down_during_the_window():
    load = Load()
    scaler = Autoscaler(WINDOWS, 0.0, 0.0)
    _drive(scaler, load, 60, 5, ready=1)  # quiet: one replica
    burst = _drive(scaler, load, 6, 80, ready=1)
    assert burst[0] >= 2  # up after one second of it: the panic window sees it at once
    assert burst[-1] == 8  # the panic window's ceil(80/10), long before the stable one sees it
    decision = scaler.decide(POLICY, 1, load.now, load.busy, 8, 0.0)
    assert decision.panicking
    # the burst ends: nothing comes down while panicking (a stable window long)
    after = _drive(scaler, load, 30, 0, ready=8)
    assert min(after) == 8
    # once the window has passed without a burst, back down to what the load needs
    later = _drive(scaler, load, 90, 5, ready=8)
    assert later[-1] == 1


def test_never_above_max_nor_below_min():
    load = Load()
    policy = Scale(2, 3, target=1, idle_sec=1)
    scaler = Autoscaler(WINDOWS, 0.0, 0.0)
    assert max(_drive(scaler, load, 20, 50, ready=3, policy=policy)) == 3
    assert _drive(scaler, load, 200, 0, ready=3, policy=policy, idle_for=500)[-1] == 2


def test_the_last_replica_goes_only_after_idle():
    load = Load()
    policy = Scale(0, 5, target=10, idle_sec=120)
    scaler = Autoscaler(WINDOWS, 0.0, 0.0)
    _drive(scaler, load, 10, 3, ready=1, policy=policy)
    assert _drive(scaler, load, 100, 0, ready=1, policy=policy, idle_for=100)[-1] == 1
    assert _drive(scaler, load, 1, 0, ready=1, policy=policy, idle_for=120) == [0]


def test_a_warm_floor_holds_from_its_cron_for_its_duration():
    office = Scale(0, 5, warm=(Warm("0 8 * * 1-5", 10 * 3600, 2),))
    monday = datetime(2026, 12, 7, tzinfo=UTC)  # a Monday
    assert warm.floor(office, monday.replace(hour=7, minute=59)) == 0
    assert warm.floor(office, monday.replace(hour=8)) == 2
    assert warm.floor(office, monday.replace(hour=17, minute=59)) == 2
    assert warm.floor(office, monday.replace(hour=18)) == 0
    saturday = datetime(2026, 12, 12, 9, tzinfo=UTC)
    assert warm.floor(office, saturday) == 0


def test_the_scaler_raises_and_lowers_a_warm_floor_on_its_schedule():
    routes = RouteTable()
    office = Scale(0, 5, idle_sec=60, warm=(Warm("0 8 * * *", 3600, 2),))
    routes.set(Route("prod", "api", 30, (), scale=office))
    written: list[int] = []

    class Backend:
        def scale(self, env: str, name: str, replicas: int) -> None:
            written.append(replicas)

        def busy(self, env: str, name: str) -> float | None:
            return None  # the replicas report nothing: the proxy's count serves

    clock = {"mono": 1000.0, "wall": datetime(2026, 12, 7, 7, 59, tzinfo=UTC)}
    scaler = Scaler(
        routes,
        lambda env: Backend(),  # type: ignore[arg-type,return-value]
        WINDOWS,
        clock=lambda: clock["mono"],
        wall=lambda: clock["wall"],
    )
    scaler.tick()
    assert written == [0]
    clock["wall"] = clock["wall"].replace(hour=8, minute=0)
    clock["mono"] += 1
    scaler.tick()
    assert written == [0, 2]
    assert scaler.status("prod", "api").floor == 2
    clock["wall"] = clock["wall"].replace(hour=9, minute=0)
    clock["mono"] += 3600  # idle all along: the floor gone, back to zero
    scaler.tick()
    assert written == [0, 2, 0]
    scaler.tick()
    assert written == [0, 2, 0]  # no change, no write


def test_load_the_replicas_report_counts_and_keeps_a_function_from_going_idle():
    """On Kubernetes calls may reach replicas past this proxy: what they report counts."""
    routes = RouteTable()
    routes.set(
        Route("prod", "api", 30, (("10.0.0.1", 8080),), scale=Scale(0, 10, target=1, idle_sec=5))
    )
    written: list[int] = []
    reported = {"busy": 0.0}

    class Backend:
        def scale(self, env: str, name: str, replicas: int) -> None:
            written.append(replicas)

        def busy(self, env: str, name: str) -> float | None:
            return reported["busy"]

    clock = {"mono": 0.0}
    scaler = Scaler(routes, lambda env: Backend(), WINDOWS, clock=lambda: clock["mono"])  # type: ignore[arg-type,return-value]
    for _ in range(10):  # 3 calls in flight all along at the replicas, none through the proxy
        clock["mono"] += 1
        reported["busy"] += 3
        scaler.tick()
    assert written[-1] == 3
    for _ in range(4):  # quiet, but for less than idle
        clock["mono"] += 1
        scaler.tick()
    assert scaler.status("prod", "api").desired >= 1
    for _ in range(120):
        clock["mono"] += 1
        scaler.tick()
    assert written[-1] == 0
