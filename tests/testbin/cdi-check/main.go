// cdi-check loads CDI spec directories with tags.cncf.io/container-device-interface/pkg/cdi and prints
// one JSON document: the load errors per spec file, every qualified device name the cache resolves, and
// for each -inject group the result of InjectDevices into an empty OCI spec (edited spec or error).
//
//	cdi-check -spec-dir DIR [-spec-dir DIR ...] [-inject name,name ...] [-annotation KEY=VALUE ...]
//
// An -annotation is one container annotation (the device plugin's cdi-annotations form): its device
// names are taken with cdi.ParseAnnotations, then injected like an -inject group.
//
//	cdi-check -serve -spec-dir DIR [-spec-dir DIR ...]
//
// With -serve the cache lives on, as containerd's does: each line read from stdin is a comma-separated
// group of names; the cache is refreshed from the spec directories and the group injected, and one JSON
// line answers (the injection plus the load errors). It ends at the end of its input.
//
// Exit status: 0 when the JSON was printed (errors are reported inside it), 2 on bad usage.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, " ") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

type injection struct {
	Annotation string    `json:"annotation,omitempty"`
	Devices    []string  `json:"devices"`
	Unresolved []string  `json:"unresolved"`
	Error      string    `json:"error,omitempty"`
	Spec       *oci.Spec `json:"spec,omitempty"`
}

type report struct {
	SpecDirs   []string            `json:"spec_dirs"`
	Errors     map[string][]string `json:"errors"`
	Devices    []string            `json:"devices"`
	Injections []injection         `json:"injections"`
}

func inject(cache *cdi.Cache, annotation string, names []string) injection {
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	unresolved, err := cache.InjectDevices(spec, names...)
	inj := injection{Annotation: annotation, Devices: names, Unresolved: unresolved}
	if inj.Devices == nil {
		inj.Devices = []string{}
	}
	if inj.Unresolved == nil {
		inj.Unresolved = []string{}
	}
	if err != nil {
		inj.Error = err.Error()
	} else {
		inj.Spec = spec
	}
	return inj
}

func splitNames(group string) []string {
	names := []string{}
	for _, n := range strings.Split(group, ",") {
		if n = strings.TrimSpace(n); n != "" {
			names = append(names, n)
		}
	}
	return names
}

type served struct {
	Errors    map[string][]string `json:"errors"`
	Injection injection           `json:"injection"`
}

func serve(dirs []string) {
	cache, err := cdi.NewCache(cdi.WithSpecDirs(dirs...), cdi.WithAutoRefresh(false))
	if err != nil && cache == nil {
		fmt.Fprintln(os.Stderr, "cdi-check:", err)
		os.Exit(1)
	}
	in := bufio.NewScanner(os.Stdin)
	enc := json.NewEncoder(os.Stdout)
	for in.Scan() {
		out := served{Errors: map[string][]string{}}
		if err := cache.Refresh(); err != nil {
			out.Errors["<refresh>"] = []string{err.Error()}
		}
		for path, errs := range cache.GetErrors() {
			for _, e := range errs {
				out.Errors[path] = append(out.Errors[path], e.Error())
			}
		}
		out.Injection = inject(cache, "", splitNames(in.Text()))
		out.Injection.Spec = nil // the caller wants to know that it resolved, not the whole OCI spec
		if err := enc.Encode(out); err != nil {
			fmt.Fprintln(os.Stderr, "cdi-check:", err)
			os.Exit(1)
		}
	}
}

func main() {
	var dirs, injects, annotations listFlag
	flag.Var(&dirs, "spec-dir", "CDI spec directory (repeatable)")
	flag.Var(&injects, "inject", "comma-separated qualified device names to inject together (repeatable)")
	flag.Var(&annotations, "annotation", "KEY=VALUE container annotation naming CDI devices (repeatable)")
	serveMode := flag.Bool("serve", false, "keep the cache; answer one group of names per stdin line")
	flag.Parse()
	if *serveMode && len(dirs) > 0 && flag.NArg() == 0 {
		serve(dirs)
		return
	}
	if len(dirs) == 0 || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: cdi-check -spec-dir DIR [-spec-dir DIR ...] [-inject name,name ...]")
		os.Exit(2)
	}

	cache, err := cdi.NewCache(cdi.WithSpecDirs(dirs...), cdi.WithAutoRefresh(false))
	out := report{SpecDirs: dirs, Errors: map[string][]string{}, Devices: []string{}, Injections: []injection{}}
	if err != nil {
		out.Errors["<cache>"] = append(out.Errors["<cache>"], err.Error())
	}
	if cache != nil {
		for path, errs := range cache.GetErrors() {
			for _, e := range errs {
				out.Errors[path] = append(out.Errors[path], e.Error())
			}
		}
		out.Devices = append(out.Devices, cache.ListDevices()...)
		sort.Strings(out.Devices)
		for _, group := range injects {
			out.Injections = append(out.Injections, inject(cache, "", splitNames(group)))
		}
		for _, a := range annotations {
			key, value, ok := strings.Cut(a, "=")
			if !ok {
				fmt.Fprintln(os.Stderr, "cdi-check: -annotation wants KEY=VALUE, got", a)
				os.Exit(2)
			}
			_, names, err := cdi.ParseAnnotations(map[string]string{key: value})
			if err != nil {
				out.Injections = append(out.Injections, injection{Annotation: key, Devices: []string{},
					Unresolved: []string{}, Error: err.Error()})
				continue
			}
			out.Injections = append(out.Injections, inject(cache, key, names))
		}
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, "cdi-check:", err)
		os.Exit(1)
	}
}
