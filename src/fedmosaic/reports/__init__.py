"""Tables and plots people can look at."""
