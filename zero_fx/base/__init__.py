"""The base layer: leaves every other layer of zero_fx may read, each importing nothing of
zero_fx but ``zero_fx.errors``. By role:

- ``compat``: the differences between torch releases, and the supported range;
- ``logs``: zero_fx's logger, its environment switch, and torch's probes kept quiet;
- ``formatting``: numbers and names as the reports print them;
- ``collective_backends``: which collective backend serves each device type on a group.

Their old paths (``zero_fx.compat``, ``zero_fx.logs``, ``zero_fx.formatting``,
``zero_fx.collective_backends``) are these modules (``zero_fx/__init__.py`` registers them)."""
