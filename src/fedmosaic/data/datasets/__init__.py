"""Built-in dataset loaders; importing this package registers them all."""

from . import cifar, digits, domains, femnist, mnist, office, svhn, tiny_imagenet, usps, vehicle  # noqa: F401
