"""Front ends that run priortr inside other serving or evaluation engines, one subpackage each."""
