"""hearth: services package."""

from services.common.hearth_files import exit_if_packages_shadowed

# Before any hearth module imports a sibling package (events, trust, ...): another distribution's would fail there
# with a confusing import error.
exit_if_packages_shadowed()
