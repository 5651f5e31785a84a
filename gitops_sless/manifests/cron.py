"""Five-field cron schedules with standard (Vixie / Kubernetes) semantics.

Both backends use this one parser so a schedule means the same thing
everywhere: day-of-week 0 is Sunday (APScheduler's own 0 is Monday, so the
local backend must not hand it the raw text), and when both day-of-month and
day-of-week are restricted a time matches when *either* does.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

__all__ = ["CronError", "Schedule", "parse"]

_FIELDS = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day-of-month", 1, 31, {}),
    (
        "month",
        1,
        12,
        {
            n: i + 1
            for i, n in enumerate(
                ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
            )
        },
    ),
    (
        "day-of-week",
        0,
        6,
        {n: i for i, n in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])},
    ),
)


# every possible date (Feb 29 included) occurs within five years of this
_LEAP_YEAR_START = datetime(2000, 1, 1)


class CronError(ValueError):
    """A schedule that is not five valid cron fields; the message says which field and why."""


@dataclass(frozen=True)
class Schedule:
    """A parsed schedule: the allowed values of each field."""

    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    days_restricted: bool
    weekdays_restricted: bool

    def matches(self, when: datetime) -> bool:
        if when.minute not in self.minutes or when.hour not in self.hours:
            return False
        if when.month not in self.months:
            return False
        day_ok = when.day in self.days
        weekday_ok = (when.isoweekday() % 7) in self.weekdays
        if self.days_restricted and self.weekdays_restricted:
            return day_ok or weekday_ok
        return day_ok and weekday_ok

    def next_after(self, when: datetime) -> datetime:
        """The first matching minute strictly after ``when`` (searches up to 5 years)."""
        t = when.replace(second=0, microsecond=0) + timedelta(minutes=1)
        limit = t + timedelta(days=366 * 5)
        while t < limit:
            if t.month not in self.months:
                t = (t.replace(day=1, hour=0, minute=0) + timedelta(days=32)).replace(day=1)
                continue
            if not self.matches(t.replace(hour=min(self.hours), minute=min(self.minutes))):
                t = t.replace(hour=0, minute=0) + timedelta(days=1)
                continue
            if t.hour not in self.hours:
                t = t.replace(minute=0) + timedelta(hours=1)
                continue
            if t.minute in self.minutes:
                return t
            t += timedelta(minutes=1)
        raise CronError(f"{self.text!r} never fires: no date matches it")


def _value(text: str, name: str, low: int, high: int, names: dict[str, int]) -> int:
    if text.lower() in names:
        return names[text.lower()]
    if not text:
        raise CronError(f"{name} field: a range or list item is missing a number")
    if not (text.isascii() and text.isdigit()):
        what = "a number or a name" if names else "a number"
        raise CronError(f"{name} field: {text!r} is not {what}")
    value = int(text)
    if not low <= value <= high:
        hint = " (0 = Sunday; use 0, not 7)" if name == "day-of-week" else ""
        raise CronError(f"{name} field: {value} is out of range {low}..{high}{hint}")
    return value


def _part(text: str, name: str, low: int, high: int, names: dict[str, int]) -> set[int]:
    body, slash, step_text = text.partition("/")
    step = 1
    if slash:
        if not (step_text.isascii() and step_text.isdigit()) or int(step_text) == 0:
            raise CronError(f"{name} field: step {step_text!r} must be a positive number")
        step = int(step_text)
    if body == "*":
        start, end = low, high
    elif "-" in body:
        first, _, last = body.partition("-")
        start, end = (_value(v, name, low, high, names) for v in (first, last))
        if start > end:
            raise CronError(f"{name} field: range {body!r} runs backwards")
    else:
        if slash:
            raise CronError(f"{name} field: a step needs '*' or a range before it, not {body!r}")
        start = end = _value(body, name, low, high, names)
    return set(range(start, end + 1, step))


def _field(text: str, name: str, low: int, high: int, names: dict[str, int]) -> frozenset[int]:
    values: set[int] = set()
    for part in text.split(","):
        if not part:
            raise CronError(f"{name} field: empty list item in {text!r}")
        values |= _part(part, name, low, high, names)
    return frozenset(values)


def parse(text: str) -> Schedule:
    """Parse ``minute hour day-of-month month day-of-week``."""
    parts = text.split()
    if text.strip().startswith("@"):
        raise CronError(
            f"{text!r}: macros like @daily are not supported; write five fields, e.g. '0 0 * * *'"
        )
    if len(parts) != 5:
        raise CronError(
            f"{text!r} has {len(parts)} fields; a schedule has five: "
            "minute hour day-of-month month day-of-week"
        )
    sets = [_field(p, *spec) for p, spec in zip(parts, _FIELDS, strict=True)]
    schedule = Schedule(
        text=text,
        minutes=sets[0],
        hours=sets[1],
        days=sets[2],
        months=sets[3],
        weekdays=sets[4],
        days_restricted=_restricted(parts[2]),
        weekdays_restricted=_restricted(parts[4]),
    )
    schedule.next_after(_LEAP_YEAR_START)  # refuses '0 0 30 2 *' and the like
    return schedule


def _restricted(field: str) -> bool:
    # as Kubernetes' parser (robfig/cron) reads it: '*/2' restricts, only '*' and '*/1' do not
    return not any(part in ("*", "*/1") for part in field.split(","))
