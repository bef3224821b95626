{{/* The name of every object: the release name (helm install nodeagent ...) unless fullnameOverride. */}}
{{- define "nodeagent.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The labels every object carries (and the DaemonSet selects its pods by). */}}
{{- define "nodeagent.labels" -}}
app.kubernetes.io/name: nodeagent
{{- end -}}

{{- define "nodeagent.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "nodeagent.configMapName" -}}
{{- default (printf "%s-config" (include "nodeagent.fullname" .)) .Values.config.name -}}
{{- end -}}

{{/* sha256 of the data of the chart's ConfigMap as JSON (keys sorted, no spaces): the pods' checksum/config. */}}
{{- define "nodeagent.configChecksum" -}}
{{- (include (print .Template.BasePath "/configmap.yaml") . | fromYaml).data | toJson | sha256sum -}}
{{- end -}}

{{/* Whether the chart writes a device-plugin config file next to config.toml. */}}
{{- define "nodeagent.devicePluginFile" -}}
{{- if or .Values.devicePlugin.config .Values.migStrategy .Values.deviceListStrategy -}}true{{- end -}}
{{- end -}}

{{/* The device-plugin config file: devicePlugin.config unchanged, else built from the two flags. */}}
{{- define "nodeagent.devicePluginConfig" -}}
{{- if .Values.devicePlugin.config -}}
{{- if or .Values.migStrategy .Values.deviceListStrategy -}}
{{- fail "devicePlugin.config is passed to the agent unchanged: set flags.migStrategy and flags.plugin.deviceListStrategy in it instead of migStrategy / deviceListStrategy" -}}
{{- end -}}
{{- .Values.devicePlugin.config -}}
{{- else -}}
version: v1
flags:
{{- with .Values.migStrategy }}
  migStrategy: {{ . }}
{{- end }}
{{- with .Values.deviceListStrategy }}
  plugin:
    deviceListStrategy: {{ . }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The agent's settings: config.agent with what the chart's own values set merged in. */}}
{{- define "nodeagent.settings" -}}
{{- $s := deepCopy .Values.config.agent -}}
{{- if ne .Values.plane "device-plugin" -}}
{{- $_ := set $s "device_plugin" (merge (dict "plane" .Values.plane) (get $s "device_plugin" | default dict)) -}}
{{- end -}}
{{- if include "nodeagent.devicePluginFile" . -}}
{{- $_ := set $s "device_plugin" (merge (dict "config" "/etc/nodeagent/device-plugin.yaml") (get $s "device_plugin" | default dict)) -}}
{{- end -}}
{{- if .Values.imex.enabled -}}
{{- $_ := set $s "imex" (merge (dict "enabled" true) (get $s "imex" | default dict)) -}}
{{- end -}}
{{- if .Values.vfio.enabled -}}
{{- $_ := set $s "vfio" (merge (dict "enabled" true) (get $s "vfio" | default dict)) -}}
{{- end -}}
{{- if .Values.fleet.enabled -}}
{{- $_ := set $s "mig" (merge (dict "fleet_namespace" .Release.Namespace) (get $s "mig" | default dict)) -}}
{{- end -}}
{{- if .Values.nodeFeature.enabled -}}
{{- $_ := set $s "publish" (merge (dict "labels" "nodefeature" "nodefeature_namespace" .Release.Namespace) (get $s "publish" | default dict)) -}}
{{- end -}}
{{- if .Values.cdi.enabled -}}
{{- $_ := set $s "runtime" (merge (dict "cdi" true) (get $s "runtime" | default dict)) -}}
{{- end -}}
{{- if ne .Values.hostPaths.kubeletRootDir "/var/lib/kubelet" -}}
{{- $_ := set $s "kubelet" (merge (dict "dir" .Values.hostPaths.kubeletRootDir) (get $s "kubelet" | default dict)) -}}
{{- end -}}
{{- $metrics := merge (get $s "metrics" | default dict) (dict "address" (printf "0.0.0.0:%v" .Values.metrics.port)) -}}
{{- $_ := set $s "metrics" $metrics -}}
{{- toJson $s -}}
{{- end -}}

{{/* One TOML value: a string, boolean, number or a list of them. */}}
{{- define "nodeagent.tomlValue" -}}
{{- $v := index . 1 -}}
{{- if or (kindIs "string" $v) (kindIs "bool" $v) (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v) (kindIs "slice" $v) -}}
{{- toJson $v -}}
{{- else -}}
{{- fail (printf "config.agent.%s: a string, boolean, number or list is expected, not %s" (index . 0) (kindOf $v)) -}}
{{- end -}}
{{- end -}}

{{/* config.toml from the settings: top-level keys first, then one [table] per map, keys sorted. */}}
{{- define "nodeagent.configToml" -}}
{{- $s := include "nodeagent.settings" . | fromJson -}}
{{- range $k, $v := $s }}
{{- if not (kindIs "map" $v) }}
{{ $k }} = {{ include "nodeagent.tomlValue" (list $k $v) }}
{{- end }}
{{- end }}
{{- range $k, $v := $s }}
{{- if kindIs "map" $v }}
[{{ $k }}]
{{- range $k2, $v2 := $v }}
{{ $k2 }} = {{ include "nodeagent.tomlValue" (list (printf "%s.%s" $k $k2) $v2) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Values the chart can only honour when it writes config.toml itself. */}}
{{- define "nodeagent.validate" -}}
{{- if not (has .Values.plane (list "device-plugin" "dra" "both")) -}}
{{- fail (printf "plane: one of device-plugin, dra, both, not %q" .Values.plane) -}}
{{- end -}}
{{- if and .Values.config.toml .Values.config.name -}}
{{- fail "config.toml and config.name: give the agent's config one way, not both" -}}
{{- end -}}
{{- $agentImex := get (.Values.config.agent | default dict) "imex" | default dict -}}
{{- if and (kindIs "map" $agentImex) (get $agentImex "enabled") (not .Values.imex.enabled) -}}
{{- fail "config.agent.imex.enabled needs the pod on the node's network with /etc/nvidia-imex: set imex.enabled=true instead" -}}
{{- end -}}
{{- $agentVfio := get (.Values.config.agent | default dict) "vfio" | default dict -}}
{{- if and (kindIs "map" $agentVfio) (get $agentVfio "enabled") (not .Values.vfio.enabled) -}}
{{- fail "config.agent.vfio.enabled needs the node's /sys writable in the agent's container: set vfio.enabled=true instead" -}}
{{- end -}}
{{- $agentMig := get (.Values.config.agent | default dict) "mig" | default dict -}}
{{- if and (kindIs "map" $agentMig) (get $agentMig "fleet_namespace") (not .Values.fleet.enabled) -}}
{{- fail "config.agent.mig.fleet_namespace needs the fleet's Role (Leases, the budget ConfigMap): set fleet.enabled=true instead" -}}
{{- end -}}
{{- $agentPublish := get (.Values.config.agent | default dict) "publish" | default dict -}}
{{- if and (kindIs "map" $agentPublish) (eq (toString (get $agentPublish "labels")) "nodefeature") (not .Values.nodeFeature.enabled) -}}
{{- fail "config.agent.publish.labels nodefeature needs the NodeFeature Role: set nodeFeature.enabled=true instead" -}}
{{- end -}}
{{- if or .Values.config.toml .Values.config.name -}}
{{- $own := list -}}
{{- if ne .Values.plane "device-plugin" }}{{ $own = append $own "plane" }}{{ end -}}
{{- if .Values.cdi.enabled }}{{ $own = append $own "cdi.enabled" }}{{ end -}}
{{- if include "nodeagent.devicePluginFile" . }}{{ $own = append $own "devicePlugin.config / migStrategy / deviceListStrategy" }}{{ end -}}
{{- if $own -}}
{{- fail (printf "%s cannot be merged into the config given as %s: set them in that config.toml (and leave them at their defaults here)" (join ", " $own) (ternary "config.toml" "config.name" (ne .Values.config.toml ""))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
