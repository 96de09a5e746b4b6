"""attnjax: attention, ViT and VQGAN + transformer prior in pure functional Flax.

Modules are imported explicitly (``from attnjax.ops import attention``) so that importing the
package stays cheap and never touches torch. The subpackages are layers, bottom to top: ops,
models, data and convert, train, tasks, inference.

Importing the package sets XLA:CPU's flags for speed before any backend starts
(``attnjax.xla_cpu``; the user's own ``$XLA_FLAGS`` win).
"""

from attnjax import xla_cpu

__version__ = "0.1.0"

xla_cpu.configure()
