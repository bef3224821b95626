"""Click subcommands: thin wrappers that call one function each and print its result."""
