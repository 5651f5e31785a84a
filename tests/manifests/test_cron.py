"""Five-field cron schedules: parsing, and when a schedule fires (UTC, 0 = Sunday)."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from gitops_sless.manifests import cron

EVERY_MINUTE = frozenset(range(60))
EVERY_HOUR = frozenset(range(24))
EVERY_DAY = frozenset(range(1, 32))
EVERY_MONTH = frozenset(range(1, 13))
EVERY_WEEKDAY = frozenset(range(7))


def fields(
    minutes=EVERY_MINUTE,
    hours=EVERY_HOUR,
    days=EVERY_DAY,
    months=EVERY_MONTH,
    weekdays=EVERY_WEEKDAY,
    days_restricted=False,
    weekdays_restricted=False,
) -> dict[str, object]:
    return {
        "minutes": frozenset(minutes),
        "hours": frozenset(hours),
        "days": frozenset(days),
        "months": frozenset(months),
        "weekdays": frozenset(weekdays),
        "days_restricted": days_restricted,
        "weekdays_restricted": weekdays_restricted,
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("* * * * *", fields(), id="every-minute"),
        pytest.param("*/5 * * * *", fields(minutes=range(0, 60, 5)), id="every-five-minutes"),
        pytest.param("0 2 * * *", fields(minutes={0}, hours={2}), id="daily-at-two"),
        pytest.param(
            "0 9 * * mon-fri",
            fields(minutes={0}, hours={9}, weekdays={1, 2, 3, 4, 5}, weekdays_restricted=True),
            id="weekdays-by-name",
        ),
        pytest.param(
            "0 9 * * MON-Fri",
            fields(minutes={0}, hours={9}, weekdays={1, 2, 3, 4, 5}, weekdays_restricted=True),
            id="names-ignore-case",
        ),
        pytest.param(
            "30 8 1,15 * *",
            fields(minutes={30}, hours={8}, days={1, 15}, days_restricted=True),
            id="day-of-month-list",
        ),
        pytest.param(
            "0 0 * jan,jul sun",
            fields(minutes={0}, hours={0}, months={1, 7}, weekdays={0}, weekdays_restricted=True),
            id="month-and-weekday-names",
        ),
        pytest.param(
            "0 8-18/4 * * *", fields(minutes={0}, hours={8, 12, 16}), id="range-with-step"
        ),
        pytest.param(
            "0 0 1-31/10 * *",
            fields(minutes={0}, hours={0}, days={1, 11, 21, 31}, days_restricted=True),
            id="day-range-with-step",
        ),
        pytest.param(
            "5,10-12,*/30 * * * *", fields(minutes={0, 5, 10, 11, 12, 30}), id="mixed-list"
        ),
        pytest.param(
            "0 0 * * 0,6",
            fields(minutes={0}, hours={0}, weekdays={0, 6}, weekdays_restricted=True),
            id="weekend-numbers",
        ),
        pytest.param(
            "0 0 * * sun-sat",
            fields(minutes={0}, hours={0}, weekdays_restricted=True),
            id="whole-week-range-is-restricted",
        ),
        pytest.param(
            "59 23 31 12 6",
            fields(
                minutes={59},
                hours={23},
                days={31},
                months={12},
                weekdays={6},
                days_restricted=True,
                weekdays_restricted=True,
            ),
            id="largest-values",
        ),
        pytest.param("  0   2  * *  *  ", fields(minutes={0}, hours={2}), id="extra-spaces"),
    ],
)
def test_parse_valid(text: str, expected: dict[str, object]) -> None:
    schedule = cron.parse(text)
    assert schedule.text == text
    actual = {key: getattr(schedule, key) for key in expected}
    assert actual == expected


FIVE = "a schedule has five: minute hour day-of-month month day-of-week"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("", f"'' has 0 fields; {FIVE}", id="empty"),
        pytest.param("* * * *", f"'* * * *' has 4 fields; {FIVE}", id="four-fields"),
        pytest.param("0 0 * * * *", f"'0 0 * * * *' has 6 fields; {FIVE}", id="six-fields"),
        pytest.param("every day ok", f"'every day ok' has 3 fields; {FIVE}", id="prose"),
        pytest.param("60 * * * *", "minute field: 60 is out of range 0..59", id="minute-60"),
        pytest.param("0 24 * * *", "hour field: 24 is out of range 0..23", id="hour-24"),
        pytest.param("0 0 0 * *", "day-of-month field: 0 is out of range 1..31", id="day-0"),
        pytest.param("0 0 32 * *", "day-of-month field: 32 is out of range 1..31", id="day-32"),
        pytest.param("0 0 * 13 *", "month field: 13 is out of range 1..12", id="month-13"),
        pytest.param("0 0 * 0 *", "month field: 0 is out of range 1..12", id="month-0"),
        pytest.param(
            "0 0 * * 7",
            "day-of-week field: 7 is out of range 0..6 (0 = Sunday; use 0, not 7)",
            id="day-of-week-7",
        ),
        pytest.param(
            "*/0 * * * *", "minute field: step '0' must be a positive number", id="step-zero"
        ),
        pytest.param(
            "*/x * * * *", "minute field: step 'x' must be a positive number", id="step-text"
        ),
        pytest.param(
            "*/ * * * *", "minute field: step '' must be a positive number", id="step-missing"
        ),
        pytest.param(
            "5/10 * * * *",
            "minute field: a step needs '*' or a range before it, not '5'",
            id="step-after-number",
        ),
        pytest.param("0 5-2 * * *", "hour field: range '5-2' runs backwards", id="backwards"),
        pytest.param(
            "0 0 * * fri-mon",
            "day-of-week field: range 'fri-mon' runs backwards",
            id="backwards-names",
        ),
        pytest.param("a b c d e", "minute field: 'a' is not a number", id="garbage"),
        pytest.param(
            "0 0 * foo *", "month field: 'foo' is not a number or a name", id="unknown-name"
        ),
        pytest.param(
            "0 0 * * 1.5", "day-of-week field: '1.5' is not a number or a name", id="fraction"
        ),
        pytest.param("1,,2 * * * *", "minute field: empty list item in '1,,2'", id="empty-item"),
        pytest.param("² * * * *", "minute field: '²' is not a number", id="superscript-digit"),
        pytest.param(
            "*/² * * * *", "minute field: step '²' must be a positive number", id="superscript-step"
        ),
        pytest.param("٣ * * * *", "minute field: '٣' is not a number", id="arabic-indic-digit"),
    ],
)
def test_parse_invalid(text: str, message: str) -> None:
    with pytest.raises(cron.CronError) as caught:
        cron.parse(text)
    assert str(caught.value) == message


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_zero_is_sunday() -> None:
    schedule = cron.parse("0 12 * * 0")
    assert at("2026-12-02 10:00").strftime("%A") == "Wednesday"
    assert schedule.next_after(at("2026-12-02 10:00")) == at("2026-12-06 12:00")
    assert at("2026-12-06").strftime("%A") == "Sunday"
    assert schedule.matches(at("2026-12-06 12:00"))
    assert not schedule.matches(at("2026-12-07 12:00"))  # Monday
    assert not schedule.matches(at("2026-12-05 12:00"))  # Saturday
    assert not schedule.matches(at("2026-12-06 12:01"))
    assert cron.parse("0 12 * * sun").weekdays == schedule.weekdays


def test_day_of_month_or_day_of_week_when_both_are_restricted() -> None:
    schedule = cron.parse("0 0 13 * 5")
    assert schedule.matches(at("2026-01-13 00:00"))  # a Tuesday, the 13th
    assert schedule.matches(at("2026-01-02 00:00"))  # a Friday, the 2nd
    assert schedule.matches(at("2026-02-13 00:00"))  # Friday the 13th
    assert not schedule.matches(at("2026-01-14 00:00"))  # neither
    fires = []
    when = at("2026-01-01 00:00")
    for _ in range(8):
        when = schedule.next_after(when)
        fires.append(when)
    assert fires == [
        at(day + " 00:00")
        for day in (
            "2026-01-02",
            "2026-01-09",
            "2026-01-13",
            "2026-01-16",
            "2026-01-23",
            "2026-01-30",
            "2026-02-06",
            "2026-02-13",
        )
    ]


def test_day_of_month_and_day_of_week_when_only_one_is_restricted() -> None:
    day_only = cron.parse("0 0 13 * *")
    assert day_only.matches(at("2026-01-13 00:00"))
    assert not day_only.matches(at("2026-01-02 00:00"))  # a Friday, but not the 13th
    weekday_only = cron.parse("0 0 * * 5")
    assert weekday_only.matches(at("2026-01-02 00:00"))
    assert not weekday_only.matches(at("2026-01-13 00:00"))  # the 13th, but a Tuesday


@pytest.mark.parametrize(
    ("text", "start", "expected"),
    [
        pytest.param("*/5 * * * *", "2026-01-01 10:03:30", ["10:05", "10:10"], id="step"),
        pytest.param("*/5 * * * *", "2026-01-01 10:05", ["10:10"], id="strictly-after"),
        pytest.param("*/5 * * * *", "2026-01-01 10:04:59.999999", ["10:05"], id="seconds"),
        pytest.param(
            "*/15 * * * *",
            "2026-12-31 23:59",
            ["2027-01-01 00:00", "2027-01-01 00:15"],
            id="new-year",
        ),
        pytest.param("0 2 * * *", "2026-01-01 02:00:30", ["2026-01-02 02:00"], id="daily"),
        pytest.param(
            "0 9 * * mon-fri",
            "2026-12-04 09:00",  # a Friday
            ["2026-12-07 09:00", "2026-12-08 09:00"],
            id="skips-weekend",
        ),
        pytest.param(
            "30 8 1,15 * *",
            "2026-01-31 12:00",
            ["2026-02-01 08:30", "2026-02-15 08:30", "2026-03-01 08:30"],
            id="month-boundary",
        ),
        pytest.param(
            "0 0 31 * *",
            "2026-04-01 00:00",
            ["2026-05-31 00:00", "2026-07-31 00:00"],
            id="skips-short-months",
        ),
        pytest.param(
            "0 0 * jan,jul sun",
            "2026-02-01 00:00",
            ["2026-07-05 00:00", "2026-07-12 00:00"],
            id="month-names",
        ),
        pytest.param(
            "0 8-18/4 * * *",
            "2026-01-01 16:00",
            ["2026-01-02 08:00", "2026-01-02 12:00", "2026-01-02 16:00"],
            id="hour-range-step",
        ),
        pytest.param("0 0 29 2 *", "2026-03-01 00:00", ["2028-02-29 00:00"], id="leap-day"),
        pytest.param("0 0 29 2 *", "2028-02-29 00:00", ["2032-02-29 00:00"], id="next-leap-day"),
        pytest.param(
            "0 0 29 2 1",
            "2026-03-01 00:00",
            ["2027-02-01 00:00", "2027-02-08 00:00"],
            id="leap-day-or-monday",
        ),
        pytest.param("0 0 1 1 *", "2026-06-01 00:00", ["2027-01-01 00:00"], id="yearly"),
    ],
)
def test_next_after(text: str, start: str, expected: list[str]) -> None:
    schedule = cron.parse(text)
    day = start.split()[0]
    wanted = [at(e if " " in e else f"{day} {e}") for e in expected]
    fires = []
    when = at(start)
    for _ in wanted:
        when = schedule.next_after(when)
        fires.append(when)
    assert fires == wanted
    assert all(schedule.matches(f) for f in fires)


@pytest.mark.parametrize("text", ["0 0 30 2 *", "0 0 31 4,6,9,11 *"])
def test_a_schedule_that_never_fires(text: str) -> None:
    with pytest.raises(cron.CronError) as caught:
        cron.parse(text)
    assert str(caught.value) == f"{text!r} never fires: no date matches it"


@pytest.mark.parametrize(
    "text",
    [
        "*/7 * * * *",
        "13 */5 * * *",
        "0 0 13 * 5",
        "45 23 * * sat,sun",
        "0 12 1-7 * mon",
        "10-20/5 9-17 * * 1-5",
        "0 0 28-31 * *",
    ],
)
@pytest.mark.parametrize("start", ["2026-01-30 22:17:45", "2026-02-28 23:59", "2028-02-28 12:00"])
def test_next_after_is_the_first_matching_minute(text: str, start: str) -> None:
    """next_after agrees with a minute-by-minute search through ``matches``."""
    schedule = cron.parse(text)
    when = at(start)
    candidate = when.replace(second=0, microsecond=0) + timedelta(minutes=1)
    while not schedule.matches(candidate):
        candidate += timedelta(minutes=1)
        assert candidate < when + timedelta(days=40)
    assert schedule.next_after(when) == candidate


def test_a_stepped_star_restricts_as_kubernetes_reads_it() -> None:
    # robfig/cron (Kubernetes): '*/2' is a restriction, so day-of-month OR day-of-week
    schedule = cron.parse("0 0 */2 * 5")
    assert schedule.matches(at("2026-12-03 00:00"))  # Thursday the 3rd: odd day
    assert schedule.matches(at("2026-12-04 00:00"))  # Friday the 4th: a Friday
    assert not schedule.matches(at("2026-12-08 00:00"))  # Tuesday the 8th: neither
