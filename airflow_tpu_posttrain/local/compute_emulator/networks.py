"""Compute Engine VPC networks, subnetworks, and Cloud Routers with a Cloud NAT: what an instance joins and reaches.

Google's behaviour: ``networks.get`` (https://cloud.google.com/compute/docs/reference/rest/v1/networks/get) and the
auto and custom subnet modes, where an instance of a custom-mode network names its subnetwork
(https://cloud.google.com/vpc/docs/vpc); ``subnetworks.get``
(https://cloud.google.com/compute/docs/reference/rest/v1/subnetworks/get) with Private Google Access
(https://cloud.google.com/vpc/docs/private-google-access); ``routers.list``
(https://cloud.google.com/compute/docs/reference/rest/v1/routers/list) with Cloud NAT
(https://cloud.google.com/nat/docs/overview). What a VM may reach is decided at its boot from these
(``local/vpc.py``). A test makes networks, subnetworks and routers (``add_network``, ``add_subnetwork``,
``add_router``); every project has the auto-mode ``default``.
"""

from __future__ import annotations

from typing import Any

from airflow_tpu_posttrain.local import vpc
from airflow_tpu_posttrain.local.compute_emulator import api


class NetworksMixin:
    """Networks (``_networks``), subnetworks (``_subnetworks``) and Cloud Routers (``_routers``)."""

    def add_network(self, name: str, custom_mode: bool, project: str | None = None) -> None:
        """Add a VPC network (every project has the auto-mode ``default``); custom-mode ones need subnetworks."""
        with self._lock:
            self._networks[(project, name)] = {"autoCreateSubnetworks": not custom_mode}

    def add_subnetwork(
        self, name: str, region: str, network: str = "default", *, private_google_access: bool = False,
        project: str | None = None,
    ) -> None:
        """A subnetwork of ``network`` in ``region``; an auto-mode network has one named after it in every region.

        Private Google Access is off unless asked for, as for the subnetworks Google makes."""
        with self._lock:
            self._subnetworks[(project, region, name)] = {
                "network": network, "privateIpGoogleAccess": private_google_access
            }

    def add_router(
        self, name: str, region: str, network: str = "default", *, nat_subnetworks: list[str] | None = None,
        project: str | None = None,
    ) -> None:
        """A Cloud Router with one Cloud NAT, for the subnetworks of its region.

        ``nat_subnetworks`` None: all of them (``--nat-all-subnet-ip-ranges``); else the named ones only."""
        with self._lock:
            self._routers[(project, region, name)] = {"network": network, "natSubnetworks": nat_subnetworks}

    def _network(self, project: str, name: str) -> dict[str, Any] | None:
        return self._networks.get((project, name)) or self._networks.get((None, name))

    def _check_network_interface(self, project: str, body: dict[str, Any]) -> None:
        """The network must exist; a custom-mode one needs a subnetwork (the real API's 400)."""
        interface = (body.get("networkInterfaces") or [{}])[0]
        network_name = (interface.get("network") or "global/networks/default").rsplit("/", 1)[-1]
        network = self._network(project, network_name)
        if network is None:
            raise api.not_found(api.resource_path(project, None, "networks", network_name))
        if not network["autoCreateSubnetworks"] and not interface.get("subnetwork"):
            raise api.ApiError(
                400,
                "invalid",
                "Invalid value for field 'resource.networkInterfaces[0]': ''. "
                "Subnetwork should be specified for custom subnetmode network",
            )

    def _get_network(self, query: dict, body: dict, project: str, name: str):
        with self._lock:
            network = self._network(project, name)
        path = api.resource_path(project, None, "networks", name)
        if network is None:
            raise api.not_found(path)
        return 200, {
            "kind": "compute#network",
            "name": name,
            "selfLink": f"{api.API_ROOT}/{path}",
            "autoCreateSubnetworks": network["autoCreateSubnetworks"],
        }

    def _subnetwork(self, project: str, region: str, name: str) -> dict[str, Any] | None:
        found = self._subnetworks.get((project, region, name)) or self._subnetworks.get((None, region, name))
        if found is not None:
            return found
        network = self._network(project, name)
        if network is not None and network["autoCreateSubnetworks"]:
            return {"network": name, "privateIpGoogleAccess": False}
        return None

    def _egress(self, project: str, zone: str, instance: dict[str, Any]) -> vpc.Egress:
        """What the instance's network interface reaches: its access config, its subnetwork's NAT and PGA.

        Called with the lock held."""
        interface = instance["networkInterfaces"][0]
        network = (interface.get("network") or "global/networks/default").rsplit("/", 1)[-1]
        subnetwork_name = (interface.get("subnetwork") or network).rsplit("/", 1)[-1]
        region = zone.rsplit("-", 1)[0]
        subnetwork = self._subnetwork(project, region, subnetwork_name) or {}
        cloud_nat = any(
            router["network"] == network
            and (router["natSubnetworks"] is None or subnetwork_name in router["natSubnetworks"])
            for (router_project, router_region, _), router in self._routers.items()
            if router_region == region and router_project in (None, project)
        )
        return vpc.egress_of(
            external_ip=bool(interface.get("accessConfigs")),
            cloud_nat=cloud_nat,
            private_google_access=bool(subnetwork.get("privateIpGoogleAccess")),
        )

    def _get_subnetwork(self, query: dict, body: dict, project: str, region: str, name: str):
        """``subnetworks.get``; an auto-mode network's subnetwork of each region exists, Private Google Access off."""
        path = f"projects/{project}/regions/{region}/subnetworks/{name}"
        with self._lock:
            subnetwork = self._subnetwork(project, region, name)
        if subnetwork is None:
            raise api.not_found(path)
        return 200, {
            "kind": "compute#subnetwork",
            "name": name,
            "network": f"{api.API_ROOT}/projects/{project}/global/networks/{subnetwork['network']}",
            "region": f"{api.API_ROOT}/projects/{project}/regions/{region}",
            "privateIpGoogleAccess": subnetwork["privateIpGoogleAccess"],
            "selfLink": f"{api.API_ROOT}/{path}",
        }

    def _list_routers(self, query: dict, body: dict, project: str, region: str):
        """``routers.list`` of a region, each router with its NAT in the API's shape."""
        items = []
        with self._lock:
            routers = [
                (name, router)
                for (router_project, router_region, name), router in sorted(self._routers.items(), key=str)
                if router_region == region and router_project in (None, project)
            ]
        for name, router in routers:
            nat: dict[str, Any] = {"name": f"{name}-nat", "natIpAllocateOption": "AUTO_ONLY"}
            if router["natSubnetworks"] is None:
                nat["sourceSubnetworkIpRangesToNat"] = "ALL_SUBNETWORKS_ALL_IP_RANGES"
            else:
                nat["sourceSubnetworkIpRangesToNat"] = "LIST_OF_SUBNETWORKS"
                nat["subnetworks"] = [
                    {
                        "name": f"{api.API_ROOT}/projects/{project}/regions/{region}/subnetworks/{subnetwork}",
                        "sourceIpRangesToNat": ["ALL_IP_RANGES"],
                    }
                    for subnetwork in router["natSubnetworks"]
                ]
            items.append(
                {
                    "kind": "compute#router",
                    "name": name,
                    "network": f"{api.API_ROOT}/projects/{project}/global/networks/{router['network']}",
                    "region": f"{api.API_ROOT}/projects/{project}/regions/{region}",
                    "nats": [nat],
                    "selfLink": f"{api.API_ROOT}/projects/{project}/regions/{region}/routers/{name}",
                }
            )
        return api.list_response("compute#routerList", f"projects/{project}/regions/{region}/routers", items)
