"""Reference pages generated from the package, so that they cannot drift from it.

Directives (usable from MyST as ```` ```{idempotency-settings} ````):

``idempotency-api``
    autodoc of every name in ``flask_idempotency.__all__``, grouped (the extension and the
    claimed key, what the background passes to your functions, errors, signals), plus the
    public modules given as arguments.
``idempotency-settings``
    one ``confval`` per field declared with ``config.option()``: its ``IDEMPOTENCY_*`` key,
    its default as written in ``app.config``, whether a route may override it, and its
    meaning from the field's ``#:`` comment. A field without one fails the build.
``idempotency-problems`` / ``idempotency-decisions``
    every :class:`~flask_idempotency.ProblemError` subclass of ``flask_idempotency.errors``
    (slug, status, title, ``Stripe-Should-Retry``, Stripe's shape), and ``answers.ANSWERS``
    (what each claim decision answers).
``idempotency-metrics``
    every metric ``PrometheusMetrics`` registers, read through ``describe()`` from a
    registry of its own (no database is touched).

At the end of the build, :func:`check_api` warns (and so fails ``-W``) for any name in
``__all__`` that did not become a documented Python object.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import logging
import pkgutil
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from pygments.lexers.shell import BashLexer
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging as sphinx_logging
from sphinx.util.docutils import SphinxDirective

logger = sphinx_logging.getLogger(__name__)

PACKAGE = "flask_idempotency"
#: a URL no connection is ever made to: init_app parses it and opens nothing
DOCS_DATABASE_URL = "postgresql://docs@localhost/docs"


def docs_app() -> Any:
    """A Flask app with the extension initialised (nothing is connected)."""
    from flask import Flask

    from flask_idempotency import Idempotency

    app = Flask("flask_idempotency_docs")
    app.config["IDEMPOTENCY_DATABASE_URL"] = DOCS_DATABASE_URL
    Idempotency(app)
    return app


class _RstDirective(SphinxDirective):
    """A directive that writes reStructuredText and parses it in place."""

    def lines(self) -> Iterator[str]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        self.env.note_reread()  # generated from the code: read again on every build
        text = StringList()
        source = self.get_source_info()[0] or self.env.docname
        for number, line in enumerate(self.lines()):
            text.append(line, source, number)
        container = nodes.section() if self.has_sections else nodes.container()
        container.document = self.state.document
        self.state.nested_parse(text, self.content_offset, container, match_titles=True)
        return list(container.children)

    has_sections = True


# -- the API ---------------------------------------------------------------------------------


def _api_groups() -> dict[str, list[str]]:
    import flask_idempotency
    from flask_idempotency import IdempotencyError

    groups: dict[str, list[str]] = {"errors": [], "modules": [], "names": []}
    for name in flask_idempotency.__all__:
        obj = getattr(flask_idempotency, name)
        if isinstance(obj, type) and issubclass(obj, IdempotencyError):
            groups["errors"].append(name)
        elif isinstance(obj, types.ModuleType):
            groups["modules"].append(name)
        else:
            groups["names"].append(name)
    return groups


#: attributes the extension's own code uses, documented for it (``#:``), not for apps
INTERNAL_MEMBERS = {"ClaimedKey": ["protected", "released", "exception", "pinned", "jobs"]}


def _autodoc(name: str) -> list[str]:
    import flask_idempotency

    obj = getattr(flask_idempotency, name)
    target = f"{PACKAGE}.{name}"
    if isinstance(obj, type):
        options = ["   :members:"]
        if issubclass(obj, enum.Enum) or dataclasses.is_dataclass(obj):
            options.append("   :undoc-members:")  # each member or field is API
        if name in INTERNAL_MEMBERS:
            options.append(f"   :exclude-members: {', '.join(INTERNAL_MEMBERS[name])}")
        return [f".. autoclass:: {target}", *options, ""]
    if inspect.isfunction(obj):
        return [f".. autofunction:: {target}", ""]
    # A value (a proxy, a sentinel): its #: comment where it is defined. autodoc would look
    # a proxy up outside a request, and give a sentinel its class's docstring.
    return [f".. py:data:: {target}", "", *(f"   {line}" for line in _data_doc(name)), ""]


def _data_doc(name: str) -> list[str]:
    """The ``#:`` comment of the package-level name *name*, wherever it is defined
    (subpackages included: RETRYABLE lives in background/)."""
    import flask_idempotency

    # walk_packages: since the store/background/cli layout, names live in subpackages too
    for module in pkgutil.walk_packages(flask_idempotency.__path__, f"{PACKAGE}."):
        try:
            docs = ModuleAnalyzer.for_module(module.name).find_attr_docs()
        except Exception:  # a subpackage's __init__ without source, say
            continue
        if ("", name) in docs:
            return [line for line in docs["", name] if line.strip()]
    logger.warning("%s.%s has no #: comment to document it by", PACKAGE, name)
    return []


class ApiDirective(_RstDirective):
    """``.. idempotency-api:: [public.module ...]``: every name of ``__all__``."""

    optional_arguments = 20

    def lines(self) -> Iterator[str]:
        groups = _api_groups()
        yield from ["The package root", "----------------", ""]
        yield "Everything below is importable from ``flask_idempotency``."
        yield ""
        for name in groups["names"]:
            yield from _autodoc(name)
        yield from ["Errors", "------", ""]
        yield "Every error derives from :class:`~flask_idempotency.IdempotencyError`. Those"
        yield "answered to a client derive from :class:`~flask_idempotency.ProblemError` as"
        yield "well, a werkzeug ``HTTPException``; see :doc:`http` for their answers."
        yield ""
        for name in groups["errors"]:
            yield from _autodoc(name)
        for name in groups["modules"]:
            title = f"``{PACKAGE}.{name}``"
            yield from [title, "-" * len(title), ""]
            yield from _module(f"{PACKAGE}.{name}")
        for module in self.arguments:
            title = f"``{module}``"
            yield from [title, "-" * len(title), ""]
            yield from _module(module)


def _module(module: str) -> Iterator[str]:
    """A public module: its classes and functions, then its documented values without
    their reprs (a signal's repr is an address, not documentation)."""
    values = [
        name for scope, name in ModuleAnalyzer.for_module(module).find_attr_docs() if not scope
    ]
    yield f".. automodule:: {module}"
    yield "   :members:"
    if values:
        yield f"   :exclude-members: {', '.join(values)}"
    yield ""
    for name in values:
        yield from [f".. autodata:: {module}.{name}", "   :no-value:", ""]


def check_api(app: Sphinx, env: Any) -> None:
    """Warn for every name of ``__all__`` that is not a documented Python object."""
    import flask_idempotency

    documented = set(env.get_domain("py").objects)
    for name in flask_idempotency.__all__:
        if f"{PACKAGE}.{name}" not in documented:
            logger.warning("%s.%s is in __all__ but not in the API reference", PACKAGE, name)


# -- the settings ----------------------------------------------------------------------------


def _default_text(value: Any) -> str:
    """The default as Python, the language ``app.config`` is written in."""
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}"
    return repr(value)


@dataclasses.dataclass
class Setting:
    key: str
    name: str
    default: Any
    route: bool
    meaning: list[str]
    type_name: str


def declared_settings() -> list[Setting]:
    """Every setting of ``config.py``, in declaration order: app-wide, then per route."""
    from flask_idempotency import config

    docs = ModuleAnalyzer.for_module(config.__name__).find_attr_docs()
    found = []
    for cls, route in ((config.Settings, False), (config.RouteSettings, True)):
        for field in dataclasses.fields(cls):
            if "convert" not in field.metadata:
                continue
            meaning = [line for line in docs.get((cls.__name__, field.name), []) if line.strip()]
            type_name = field.type if isinstance(field.type, str) else field.type.__name__
            found.append(
                Setting(
                    config.config_key(field.name),
                    field.name,
                    field.metadata["default"],
                    route,
                    meaning,
                    type_name,
                )
            )
    return found


def _sentence(lines: list[str]) -> list[str]:
    """A ``#:`` comment as a sentence: capitalised, with its full stop."""
    if not lines:
        return lines
    first, last = lines[0].strip(), lines[-1].rstrip()
    lines = [first[:1].upper() + first[1:], *lines[1:]]
    if not last.endswith((".", ")", "``")):
        lines[-1] = lines[-1].rstrip() + "."
    return lines


class SettingsDirective(_RstDirective):
    """``.. idempotency-settings::``: one ``confval`` per declared setting."""

    has_sections = False

    def lines(self) -> Iterator[str]:
        from flask_idempotency import config

        settings = declared_settings()
        keys = {s.key for s in settings}
        if keys != set(config.DEFAULTS):
            logger.warning(
                "settings reference: declared %s, DEFAULTS %s",
                sorted(keys - set(config.DEFAULTS)),
                sorted(set(config.DEFAULTS) - keys),
                location=self.get_location(),
            )
        rows = [
            [
                f":confval:`{s.key}`",
                f"``{_default_text(s.default)}``",
                f"``{s.name}=``" if s.route else "app-wide",
            ]
            for s in settings
        ]
        yield from _table(["key", "default", "route option"], rows)
        for setting in settings:
            if not setting.meaning:
                logger.warning(
                    "%s (config.py field %r) has no #: comment saying what it means",
                    setting.key,
                    setting.name,
                    location=self.get_location(),
                )
            yield f".. confval:: {setting.key}"
            yield f"   :type: ``{setting.type_name}``"
            yield f"   :default: ``{_default_text(setting.default)}``"
            yield ""
            for line in _sentence(setting.meaning):
                yield f"   {line}"
            yield ""
            if setting.route:
                yield f"   Per route: ``@idempotency.idempotent({setting.name}=...)``."
            else:
                yield "   App-wide only (no route option)."
            yield ""


# -- HTTP answers ----------------------------------------------------------------------------


def problem_classes() -> list[type[Any]]:
    """Every concrete problem of ``flask_idempotency.errors``, in source order."""
    from flask_idempotency import errors

    found = [
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type)
        and issubclass(obj, errors.ProblemError)
        and obj is not errors.ProblemError
    ]
    return found  # a module's namespace keeps the order of definition


def _public_path(cls: type[Any]) -> str:
    import flask_idempotency

    if getattr(flask_idempotency, cls.__name__, None) is cls:
        return f":class:`~{PACKAGE}.{cls.__name__}`"
    return f"``{cls.__name__}`` (not exported)"


def _table(header: list[str], rows: list[list[str]]) -> Iterator[str]:
    yield ".. list-table::"
    yield "   :header-rows: 1"
    yield ""
    for row in [header, *rows]:
        first, *rest = row
        yield f"   * - {first}"
        for cell in rest:
            yield f"     - {cell}"
    yield ""


class ProblemsDirective(_RstDirective):
    """``.. idempotency-problems::``: every problem the extension answers."""

    has_sections = False

    def lines(self) -> Iterator[str]:
        from flask_idempotency.errors import DEFAULT_PROBLEM_TYPE_BASE

        rows, meanings = [], []
        for cls in problem_classes():
            retry = {True: "``true``", False: "``false``", None: "(absent)"}[cls.should_retry]
            stripe = f"{cls.stripe_status or cls.code} ``{cls.stripe_type}``"
            state = f"``{cls.operation_state}``, ``{str(cls.safe_new_key).lower()}``"
            rows.append([f"``{cls.slug}``", f"{cls.code}", retry, state, stripe, _public_path(cls)])
            doc = " ".join(inspect.getdoc(cls).split()) if cls.__doc__ else ""
            meanings += [f"``{cls.slug}``", f"   *{cls.title}.* {doc}", ""]
        yield "The ``type`` of each problem is ``IDEMPOTENCY_PROBLEM_TYPE_BASE`` + the slug;"
        yield f"by default ``{DEFAULT_PROBLEM_TYPE_BASE}key-reused`` and so on."
        yield ""
        yield from _table(
            [
                "slug",
                "status",
                "``Stripe-Should-Retry``",
                "``operation_state``, ``safe_new_key``",
                "Stripe format",
                "raised as",
            ],
            rows,
        )
        yield ""
        yield (
            "Every problem carries the members ``operation_state`` (what became of the key's"
            " operation: ``none``, no claim exists; ``processing``; ``completed``;"
            " ``released``; ``abandoned``, proven not to have taken effect; ``unknown``;"
            " ``expired``) and ``safe_new_key`` (true only when no effect of this key can have"
            " happened, so the request may be sent again under a new key), SPEC §24. The"
            " table gives each problem's usual pair; ``key-reused`` tells the key's own state"
            " (``processing``, ``completed``, ``abandoned``, ``unknown``, or ``expired`` for a"
            " tombstone), and ``key-expired`` answering a request first sent longer ago than"
            " its TTL says ``unknown``."
        )
        yield ""
        yield "Each problem's ``title``, and when it is raised:"
        yield ""
        yield from meanings


class DecisionsDirective(_RstDirective):
    """``.. idempotency-decisions::``: what each claim decision answers (``ANSWERS``)."""

    has_sections = False

    def lines(self) -> Iterator[str]:
        from flask_idempotency.answers import ANSWERS
        from flask_idempotency.model import Decision

        docs = ModuleAnalyzer.for_module(Decision.__module__).find_attr_docs()
        rows = []
        for decision, answer in ANSWERS.items():
            meaning = " ".join(docs.get(("Decision", decision.name), []))
            if answer.problem is None:
                what = "the view runs" if decision is not Decision.REPLAY else "the replay"
            else:
                what = f"``{answer.problem.slug}`` ({answer.problem.code})"
            rows.append(
                [
                    f"``{decision.value}``",
                    meaning.strip() or "(none)",
                    what,
                    "yes" if answer.retry_after else "no",
                    logging.getLevelName(answer.level),
                ]
            )
        yield from _table(
            ["decision (log ``decision=``)", "meaning", "answer", "``Retry-After``", "log level"],
            rows,
        )


# -- metrics ---------------------------------------------------------------------------------


def registered_metrics() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """``(name as scraped, type, help, labels)`` of every metric ``PrometheusMetrics``
    registers, from ``describe()``: nothing is collected, so no database is asked."""
    from prometheus_client import CollectorRegistry

    from flask_idempotency.metrics import PrometheusMetrics

    collectors: list[Any] = []

    class Recording(CollectorRegistry):
        def register(self, collector: Any) -> None:
            collectors.append(collector)
            super().register(collector)

    PrometheusMetrics(docs_app(), registry=Recording())
    found = []
    for collector in collectors:
        describe = getattr(collector, "describe", None)
        if describe is None:
            logger.warning(
                "metrics reference: %s has no describe(); its metrics are not listed",
                type(collector).__name__,
            )
            continue
        for family in describe():
            # prometheus_client keeps label names on the metric and on the family alike
            labels = tuple(
                getattr(collector, "_labelnames", ()) or getattr(family, "_labelnames", ())
            )
            name = family.name + ("_total" if family.type == "counter" else "")
            found.append((name, family.type, family.documentation, labels))
    return found


class MetricsDirective(_RstDirective):
    """``.. idempotency-metrics::``: every metric, its type, labels and help text."""

    has_sections = False

    def lines(self) -> Iterator[str]:
        rows = [
            [f"``{name}``", kind, ", ".join(f"``{label}``" for label in labels) or "(none)", text]
            for name, kind, text, labels in registered_metrics()
        ]
        yield from _table(["metric", "type", "labels", "help"], rows)


def internal_class_names() -> list[str]:
    """The classes of the package's modules that are not public: type hints name them,
    and they have no page of their own (for ``nitpick_ignore``)."""
    import importlib

    import flask_idempotency

    public = set(flask_idempotency.__all__)
    names = set()
    for module in pkgutil.walk_packages(flask_idempotency.__path__, f"{PACKAGE}."):
        try:
            loaded = importlib.import_module(module.name)
        except ImportError:  # an optional integration whose extra is not installed
            continue
        for name, obj in vars(loaded).items():
            if isinstance(obj, type) and name not in public and not name.startswith("__"):
                names.add(name)
                names.add(f"{module.name}.{name}")
    return sorted(names)


def restore_defining_modules(app: Sphinx) -> None:
    """Point each public class's ``__module__`` back at the module that defines it, for
    this build only. The package root sets it to ``flask_idempotency`` (the public path);
    autodoc then reads the root's source for the ``#:`` comments of instance attributes
    (``ClaimedKey.key``) and finds none. The documented names stay the public ones."""
    import importlib

    import flask_idempotency

    modules = [m.name for m in pkgutil.walk_packages(flask_idempotency.__path__, f"{PACKAGE}.")]
    for name in flask_idempotency.__all__:
        obj = getattr(flask_idempotency, name)
        if not isinstance(obj, type) or obj.__module__ != PACKAGE:
            continue
        for module in modules:
            try:
                defined = ModuleAnalyzer.for_module(module).find_tags()
                loaded = importlib.import_module(module)
            except Exception:  # an optional integration whose extra is not installed
                continue
            if defined.get(name, ("",))[0] == "class" and getattr(loaded, name, None) is obj:
                obj.__module__ = module
                break


#: public classes that only the extension makes: their constructor is not API
CONSTRUCTED_BY_THE_EXTENSION = {f"{PACKAGE}.ClaimedKey"}


def hide_internal_constructor(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, signature: str, annotation: str
) -> tuple[str, str] | None:
    if what == "class" and name in CONSTRUCTED_BY_THE_EXTENSION:
        return "", annotation
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    # docs/deployment.md shows crontab lines; they read well as shell
    app.add_lexer("cron", BashLexer)
    app.add_directive("idempotency-api", ApiDirective)
    app.add_directive("idempotency-settings", SettingsDirective)
    app.add_directive("idempotency-problems", ProblemsDirective)
    app.add_directive("idempotency-decisions", DecisionsDirective)
    app.add_directive("idempotency-metrics", MetricsDirective)
    app.connect("builder-inited", restore_defining_modules)
    app.connect("env-check-consistency", check_api)
    app.connect("autodoc-process-signature", hide_internal_constructor)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
