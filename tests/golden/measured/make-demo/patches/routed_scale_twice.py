"""routed_scaling_factor applied in the router and again on the output."""

from needlescope.audit.substitutes import routed_scale_twice


def apply(model):
    return routed_scale_twice(model)
