"""The composition layer: what assembles the system from the library, the workers and the
coordinator (LocalEngine, scheduler factories, Ray actors, the CLI, bench, loadtest). The only
package that imports all the others; nothing imports it but entry points and the `specdec`
facade."""
