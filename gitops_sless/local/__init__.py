"""The local backend: functions built into artifact folders and run as processes."""

__all__: list[str] = []
