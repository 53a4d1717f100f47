"""What `stampout.export` does: a captured program lowered to an ExportedProgram that keeps regions."""
