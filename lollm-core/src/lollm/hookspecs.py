"""The plugin contract of lollm: every hook a family plugin may implement.

This module is the whole contract between lollm-core and family plugins; its
docstrings are the plugin author's reference (see docs/plugins.md for a worked
example). It imports neither torch nor any model code.

A plugin is a module named by an entry point in the group ``lollm.families``::

    # pyproject.toml of your distribution
    [project.entry-points."lollm.families"]
    mine = "my_package.plugin"

and that module implements hooks with :data:`hookimpl`::

    from lollm.hookspecs import hookimpl
    from lollm.family import Family, CONTRACT_VERSION

    @hookimpl
    def lollm_register_families(register):
        register(Family(name="mine", contract=CONTRACT_VERSION,
                        model_types=("mine",), load="my_package.mine:load"))

pluggy lets an implementation accept a subset of a hook's arguments, so core
can add arguments later without breaking existing plugins; arguments are never
renamed or removed (that would need a new :data:`lollm.family.CONTRACT_VERSION`).
"""

import pluggy

PROJECT_NAME = "lollm"
#: Entry-point group scanned for plugins.
ENTRY_POINT_GROUP = "lollm.families"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Decorator for a plugin's hook implementations.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def lollm_register_families(register):
    """Register the model families this plugin provides.

    Called once per process, when core first needs the list of families
    (routing a checkpoint, ``lollm families``).

    :param register: a callable taking one :class:`lollm.family.Family`; call it
        once per family. Core validates each record at once (contract version,
        field types) and raises :class:`lollm.errors.PluginError` naming the plugin
        on a bad one. Two families, from any plugins, that claim the same model
        type or GGUF architecture are both listed; routing that type is an error
        naming both (no silent pick) unless the user chooses one with
        ``--family NAME`` (docs/plugin-loading.md).
    :returns: nothing; return values are ignored.

    Keep the module that implements this hook light: import no torch and no
    model code at its top level, only :mod:`lollm.hookspecs` and :mod:`lollm.family`.
    """


@hookspec
def lollm_register_install_hints(register):
    """Say which distribution serves model types this plugin does not serve itself.

    Called once per process, right after :func:`lollm_register_families`, in
    the same guard. The hints are read only to write the error for a checkpoint
    that no installed family serves ("no installed lollm family serves model
    type 'llama'. It is provided by the distribution 'lollm-llama': pip install
    lollm-llama"). Useful to a meta-plugin or an index of families that knows
    where the others live; a family's own types need no hint (when it is
    installed it serves them), and lollm-core keeps the hints for its
    first-party distributions itself (:data:`lollm.load.registry.FIRST_PARTY_MODEL_TYPES`).

    :param register: a callable ``register(install, *, model_types=(),
        gguf_architectures=())``: ``install`` is the distribution to ``pip
        install`` (a plain name, extras allowed: ``"lollm-llama"``,
        ``"lollm-x[cuda]"``); ``model_types`` the HF ``model_type`` values and
        ``gguf_architectures`` the GGUF ``general.architecture`` values it
        serves (tuples of strings, at least one key in all). Call it once per
        distribution. Core validates each call at once and raises
        :class:`lollm.errors.PluginError` naming the plugin on a bad one (the
        plugin is then listed as broken, as for a bad family). Two plugins
        that name different distributions for one type are not an error: the
        message shows both.
    :returns: nothing; return values are ignored.
    """
