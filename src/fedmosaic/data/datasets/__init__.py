"""Built-in dataset loaders; importing this package registers them all."""
