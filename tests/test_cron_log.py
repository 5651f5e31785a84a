"""serve's log says which cron schedule ran and how it went, in words."""

from __future__ import annotations

import re

from . import gitserver
from .test_serve import manifest, setup

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve

BEAT = "def main(event, context=None):\n    return {'beat': True}\n"
EVERY_MINUTE = '    triggers: [{type: http}, {type: cron, schedule: "* * * * *"}]'


def test_a_cron_run_is_logged_with_its_schedule_and_result(setup):
    setup.push({"beat/sless.yaml": manifest("beat", EVERY_MINUTE), "beat/handler.py": BEAT})
    server = setup.serve()
    line = re.compile(r'cron\.succeeded +prod beat: cron "\* \* \* \* \*" succeeded in \d+ ms')
    server.wait(lambda: line.search(server.output()), "a logged cron run", timeout=90)
    assert "cron trigger 0 ran" not in server.output()
