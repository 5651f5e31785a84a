"""Shell completion: the bash and zsh scripts, written from the parser itself.

``gitops-sless completion bash|zsh`` prints a script; the script asks
``gitops-sless __complete envs|functions`` for the names a running server knows.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from .client import Client, ClientError, segment, server_url
from .common import EXIT_ERROR, EXIT_OK, exit_epilog

__all__ = ["add_parser", "bash_script", "commands_of", "complete", "zsh_script"]


def add_parser(commands: Any, root: argparse.ArgumentParser) -> None:
    """``completion``; ``root`` is the whole command line, complete by the time it runs."""
    completion = commands.add_parser(
        "completion",
        help="print a shell completion script: source <(gitops-sless completion bash)",
        epilog=exit_epilog("completion"),
    )
    completion.add_argument("shell", choices=("bash", "zsh"))

    def run(args: argparse.Namespace) -> int:
        script = bash_script(root) if args.shell == "bash" else zsh_script(root)
        sys.stdout.write(script)
        return EXIT_OK

    completion.set_defaults(run=run)


def complete(argv: Sequence[str]) -> int:
    """``__complete envs|functions|names [--server URL]``: names for the shell, quietly
    (``functions`` as ENV/NAME, ``names`` as NAME alone)."""
    server = None
    if "--server" in argv[:-1]:
        server = argv[list(argv).index("--server") + 1]
    try:
        tokens = os.environ.get("SLESS_API_TOKEN"), os.environ.get("SLESS_READ_TOKEN")
        with Client(server_url(server), tokens[0], timeout=2, read_token=tokens[1]) as client:
            envs = [e["name"] for e in client.get("/api/v1/environments")]
            if argv[:1] == ["envs"]:
                print("\n".join(envs))
                return EXIT_OK
            found = [
                (env, fn["name"])
                for env in envs
                for fn in client.get(f"/api/v1/environments/{segment(env)}/functions")
            ]
            if argv[:1] == ["names"]:
                print("\n".join(sorted({name for _, name in found})))
            else:
                print("\n".join(f"{env}/{name}" for env, name in found))
    except (ClientError, ValueError, KeyError, TypeError):
        return EXIT_ERROR
    return EXIT_OK


# what the value of an option or positional completes to, by its dest: a kind, or choices
_DIRS = ("path", "state_dir", "secrets_dir")
_NAMES = {"function": "functions"}


def _value_kind(action: argparse.Action, talks_to_server: bool) -> str | list[str]:
    if action.choices:
        return [str(choice) for choice in action.choices]
    if action.dest in _DIRS and (action.dest != "path" or not action.option_strings):
        return "dirs"
    if action.dest in _NAMES:  # a --function flag takes a NAME, the positional ENV/NAME
        return "names" if action.option_strings else _NAMES[action.dest]
    if action.dest == "env" and talks_to_server:
        return "envs"
    if action.dest in ("data", "repo"):
        return "files"
    return "none"


def commands_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def bash_script(parser: argparse.ArgumentParser) -> str:
    commands = commands_of(parser)
    cases, nested = [], []
    for name, sub in commands.items():
        cases.append(_bash_case(name, sub))
        for inner, action in commands_of(sub).items():  # invocations list, import terraform
            cases.append(_bash_case(f"{name} {inner}", action))
            nested += [] if name in nested else [name]
    return (
        _BASH_TEMPLATE.replace("@COMMANDS@", " ".join(commands))
        .replace("@NESTED@", " ".join(nested))
        .replace("@CASES@", "\n".join(cases))
        .lstrip()
    )


def _bash_case(name: str, sub: argparse.ArgumentParser) -> str:
    """The ``case`` branch of one command (``"invocations list"`` for a nested one)."""
    server = any("--server" in a.option_strings for a in sub._actions)
    options, values, positional = [], [], "none"
    for action in sub._actions:
        if not action.option_strings:
            kind = _value_kind(action, server)
            positional = kind if isinstance(kind, str) else "words:" + " ".join(kind)
            continue
        options += action.option_strings
        if action.nargs != 0:
            kind = _value_kind(action, server)
            word = kind if isinstance(kind, str) else "words:" + " ".join(kind)
            values.append(f"            {'|'.join(action.option_strings)}) kind='{word}' ;;")
    label = f'"{name}"' if " " in name else name
    return (
        f"        {label})\n"
        f"            options='{' '.join(options)}'\n"
        f"            positional='{positional}'\n"
        f'            case "$prev" in\n' + "\n".join(values) + "\n            esac ;;"
    )


_BASH_TEMPLATE = r"""
# bash completion for gitops-sless
#   source <(gitops-sless completion bash)      # now, or from ~/.bashrc
# ENV/NAME, --env and --function values come from the server (--server or $SLESS_SERVER).
_gitops_sless_names() {
    local server=""
    if [[ $COMP_LINE =~ --server[=\ ]+([^ ]+) ]]; then server=${BASH_REMATCH[1]}; fi
    "${COMP_WORDS[0]}" __complete "$1" ${server:+--server "$server"} 2>/dev/null
}

_gitops_sless() {
    local cur prev cmd="" i
    cur="${COMP_WORDS[COMP_CWORD]}"
    prev="${COMP_WORDS[COMP_CWORD-1]}"
    for ((i = 1; i < COMP_CWORD; i++)); do
        [[ ${COMP_WORDS[i]} == -* ]] && continue
        if [[ -z $cmd ]]; then
            cmd="${COMP_WORDS[i]}"
            [[ " @NESTED@ " == *" $cmd "* ]] || break
        else
            cmd="$cmd ${COMP_WORDS[i]}"
            break
        fi
    done
    if [[ -z $cmd ]]; then
        COMPREPLY=($(compgen -W "@COMMANDS@ --version --help" -- "$cur"))
        return
    fi
    local options="" positional="none" kind=""
    case "$cmd" in
@CASES@
        *) return ;;
    esac
    if [[ -z $kind ]]; then
        if [[ $cur == -* ]]; then
            COMPREPLY=($(compgen -W "$options" -- "$cur"))
            return
        fi
        kind=$positional
    fi
    case "$kind" in
        dirs) COMPREPLY=($(compgen -d -- "$cur")) ;;
        files) COMPREPLY=($(compgen -f -- "$cur")) ;;
        envs | functions | names)
            COMPREPLY=($(compgen -W "$(_gitops_sless_names "$kind")" -- "$cur")) ;;
        words:*) COMPREPLY=($(compgen -W "${kind#words:}" -- "$cur")) ;;
        *) COMPREPLY=() ;;
    esac
}

complete -o default -F _gitops_sless gitops-sless
"""


def _zsh_quote(text: str) -> str:
    """Text for a single-quoted zsh _arguments spec: brackets and quotes escaped."""
    text = " ".join(text.split())
    return text.replace("\\", "\\\\").replace("[", "\\[").replace("]", "\\]").replace("'", "'\\''")


_ZSH_ACTIONS = {
    "dirs": "_files -/",
    "files": "_files",
    "envs": "_gitops_sless_envs",
    "functions": "_gitops_sless_functions",
    "names": "_gitops_sless_function_names",
    "none": " ",
}


def _zsh_action(kind: str | list[str]) -> str:
    return f"({' '.join(kind)})" if isinstance(kind, list) else _ZSH_ACTIONS[kind]


def zsh_script(parser: argparse.ArgumentParser) -> str:
    commands = commands_of(parser)
    helps = _helps(parser)
    described = "\n".join(
        "    '{}:{}'".format(name, _zsh_quote(helps.get(name, "")).replace(":", "\\:"))
        for name in commands
    )
    cases = []
    for name, sub in commands.items():
        arguments = _zsh_arguments(sub)
        inner = commands_of(sub)
        if inner:  # invocations list, import terraform: the action, then its own arguments
            branches = "\n".join(
                f"                            {action})\n"
                f"                                {_zsh_arguments(parser)} ;;"
                for action, parser in inner.items()
            )
            arguments = (
                f"{arguments.replace('_arguments ', '_arguments -C ', 1)} \\\n"
                "                '*::argument:->nested'\n"
                "                case $state in\n"
                "                    nested)\n"
                "                        case $words[1] in\n"
                f"{branches}\n"
                "                        esac ;;\n"
                "                esac"
            )
        cases.append(f"            {name})\n                {arguments} ;;")
    return (
        _ZSH_TEMPLATE.replace("@DESCRIBED@", described)
        .replace("@CASES@", "\n".join(cases))
        .lstrip()
    )


def _zsh_arguments(sub: argparse.ArgumentParser) -> str:
    """``_arguments`` with a spec for each option and positional of one command."""
    server = any("--server" in a.option_strings for a in sub._actions)
    specs = []
    for action in sub._actions:
        kind = _value_kind(action, server)
        help_text = _zsh_quote(
            (action.help or "")
            .replace("%(default)s", str(action.default))
            .replace("%(default)g", str(action.default))
        )
        if not action.option_strings:
            label = (action.metavar or action.dest).replace(":", "")
            specs.append(f"'1:{label}:{_zsh_action(kind)}'")
            continue
        flags = action.option_strings
        exclusive = f"({' '.join(flags)})" if len(flags) > 1 else ""
        names = flags[0] if len(flags) == 1 else "{" + ",".join(flags) + "}"
        value = ""
        if action.nargs != 0:
            label = str(action.metavar or action.dest).replace(":", "").replace("'", "")
            value = f":{label}:{_zsh_action(kind)}"
        repeat = "*" if isinstance(action, argparse._AppendAction) else ""
        prefix = f"'{repeat or exclusive}'" if (repeat or exclusive) else ""
        specs.append(f"{prefix}{names}'[{help_text}]{value}'")
    return "_arguments " + " \\\n                ".join(specs)


_ZSH_TEMPLATE = r"""
#compdef gitops-sless
# zsh completion for gitops-sless
#   source <(gitops-sless completion zsh)       # now, or from ~/.zshrc after compinit
#   gitops-sless completion zsh > "${fpath[1]}/_gitops-sless"   # or install it
# ENV/NAME, --env and --function values come from the server (--server or $SLESS_SERVER).

_gitops_sless_names() {
    local server=${opt_args[--server]}
    "$_gitops_sless_program" __complete "$1" ${server:+--server "$server"} 2>/dev/null
}

_gitops_sless_envs() {
    local -a names
    names=(${(f)"$(_gitops_sless_names envs)"})
    _describe -t environments 'environment' names
}

_gitops_sless_functions() {
    local -a names
    names=(${(f)"$(_gitops_sless_names functions)"})
    _describe -t functions 'function' names
}

_gitops_sless_function_names() {
    local -a names
    names=(${(f)"$(_gitops_sless_names names)"})
    _describe -t functions 'function' names
}

_gitops_sless() {
    local curcontext="$curcontext" state line _gitops_sless_program=$words[1]
    typeset -A opt_args
    _arguments -C \
        '(- *)--version[print the version]' \
        '(- *)'{-h,--help}'[show help]' \
        '1:command:->command' \
        '*::argument:->argument'
    case $state in
        command)
            local -a commands
            commands=(
@DESCRIBED@
            )
            _describe -t commands 'gitops-sless command' commands
            ;;
        argument)
            case $words[1] in
@CASES@
            esac
            ;;
    esac
}

if [[ $funcstack[1] == _gitops-sless ]]; then
    _gitops_sless "$@"
else
    compdef _gitops_sless gitops-sless
fi
"""
