"""Command line of tierio (`tierio --help`)."""
