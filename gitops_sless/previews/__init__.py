"""Pull-request previews: one environment ``pr-<number>`` per open pull request.

Owns the previews' lifecycle (``environments``), which commit a preview may run
(``trust``), the forges' REST APIs (``forge`` over ``forgehttp``), what a forge
says about pull requests (``pulls``), reporting back to the pull request
(``reporter``) and a pull request's web page (``prlinks``).

May import: the coordinator (``reconciler``) and everything below it; never the
web side.
"""
