"""The runtime: worker threads per device run the stage programs the compiler made."""
