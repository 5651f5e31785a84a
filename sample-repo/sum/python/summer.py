"""Job handler: {"numbers": [1, 2, 3.5, 4]} -> {"sum": 10.5}."""


def handler(event, context=None):
    numbers = event.get("numbers")
    if not isinstance(numbers, list):
        raise ValueError(f"'numbers' must be a list of numbers, got {numbers!r}")
    for i, n in enumerate(numbers):
        # bool is a subclass of int in Python; true/false are not numbers here.
        if isinstance(n, bool) or not isinstance(n, (int, float)):
            raise ValueError(f"numbers[{i}] is {n!r}, not a number")
    return {"sum": sum(numbers)}  # printed as the job's JSON result
